"""Test support: the tiny model kit, fault hooks and the probe workers the tests launch."""
