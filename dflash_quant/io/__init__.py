"""File I/O below every stage: which files hold a model's weights in each format, their hashes and sizes."""
