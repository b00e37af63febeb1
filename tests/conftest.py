"""Shared test set-up. This folder is on the import path (pytest puts a conftest's folder there), so the
helpers beside it (ddp_reference, user_models, work_count) import by name from every test folder."""

import os

# The suite plans with zdsl's default machine profile: no test calibrates this machine by accident, reads
# its cached profile or writes one; tests/compiler/test_profile_cache.py turns it on where it tests it.
os.environ["ZDSL_CALIBRATE"] = "0"
