"""click commands, one module per area; each is a thin wrapper over the library."""
