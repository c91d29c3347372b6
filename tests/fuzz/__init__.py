"""libFuzzer targets over memguard's C parsers; see run.py."""
