"""Small shared pieces: user-facing errors and CLI plumbing."""
