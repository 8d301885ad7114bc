//! kvxfer in-process backend
