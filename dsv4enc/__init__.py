"""dsv4enc: batch encoder for the DeepSeek-V4 vision tower."""

__version__ = "0.1.0"
