"""Starting ranks: launcher detection, the Accelerator and process group, peers, hosts, per-rank memory budget."""
