"""the tower: the model's config, weights and tensors (math, transform, checkpoint, hub,
fusion, tensor-parallel slicing). Knows no runner, no device loop, no output."""
