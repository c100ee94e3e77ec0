"""Runtime: the mesh registry, communicators and symmetric memory."""
