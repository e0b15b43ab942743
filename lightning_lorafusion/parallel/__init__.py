"""Pipeline schedules, their simulator, the P2P executor and the Lightning Strategy."""
