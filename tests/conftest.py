"""Shared test set-up. This folder is on the import path (pytest puts a conftest's folder there), so the
helpers beside it (ddp_reference, user_models, work_count) import by name from every test folder."""
