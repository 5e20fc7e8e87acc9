"""images: a path, bytes or a header, before patches exist (discovery, containers,
formats, header probes, the decode pool and its shared arena). Plain values in, torch-free
at import (the early start runs it before torch is imported)."""
