"""The Hugging Face tests need transformers (the test extra has it: `pip install 'zdsl[test]'`)."""
import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("transformers") else ["test_*.py"]
