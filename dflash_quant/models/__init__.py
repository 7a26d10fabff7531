"""The drafter models (DFlash, DFlash2), their config and its checks, and where a model's parts are placed."""
