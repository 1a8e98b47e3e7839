"""meshtrain: SPMD training of large models over a (data, fsdp, tensor, stage) device mesh."""
