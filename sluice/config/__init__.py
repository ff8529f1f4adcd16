"""The run configuration: one typed tree loaded from YAML with overrides (``tree``) and the
reference page generated from it (``reference``)."""
