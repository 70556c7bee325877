"""The client room: what only the encoder client uses (EncoderClient, its HTTP exchange, packing, polls, token)."""
