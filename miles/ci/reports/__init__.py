"""Reports: the run record, its renderings (JUnit, Markdown, JSON), durations, calibration and the audit."""
