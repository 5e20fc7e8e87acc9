"""output: rows, Parquet and manifests (schema, parts and stores, the writer thread,
resume, the joined single file, the remote output, reading back, ``inspect``). Takes plain
values, never the run's options, topology or summary.
"""
