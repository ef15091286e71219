"""The artifact store, stage keys, pointers and leases: written by the driver and by ranks' committers."""
