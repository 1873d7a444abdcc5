"""Side-by-side benchmark of depth policies on one engine, and its reports."""
