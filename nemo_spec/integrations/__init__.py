"""Optional integrations with other frameworks (each module imports its framework and fails clearly without it)."""
