"""the engine: a packed batch on one device (device and dtype, attention and graphs,
the batch loop). Takes a built tower, never the command line's options."""
