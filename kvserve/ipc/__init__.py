"""The engine-core process and the one codec between it and the HTTP process."""
