"""Helpers the tests share (never collected: no file here is named ``test_*``). Fixtures stay in conftest.py."""
