"""Cost models: communication (comm), compute (compute), memory (memory)."""
