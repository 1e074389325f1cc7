"""Tests of recurra_models (a package, so that test_nn.py and test_rwkv.py do not clash with
the modules of the same name in tests/core under pytest's default import mode)."""
