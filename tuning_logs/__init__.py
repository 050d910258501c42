"""MetaSchedule tuning logs shipped with the package (data only; see README.md here)."""
