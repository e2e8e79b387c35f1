"""Training pipeline of the bundled default model (see README.md here)."""
