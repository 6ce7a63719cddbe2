//! Parsers and readers for sysfs files (in progress).
