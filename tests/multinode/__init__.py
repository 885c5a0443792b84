"""A two-node test rig on one machine: two network namespaces joined by a veth pair,
one private sshd per "node" (see rig.py), and the pytest fixture that shares it."""
