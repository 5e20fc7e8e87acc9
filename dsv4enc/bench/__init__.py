"""bench: ``dsv4enc bench`` (the model's throughput) and ``bench --host`` (the host's
capacity, with a null model stage)."""
