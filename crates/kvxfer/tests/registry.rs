//! Link-time registration can silently drop a backend crate nothing references. Every backend enabled
//! by a cargo feature must be in the `inventory` registry, and creatable by name.

use kvxfer::backends;
use kvxfer_core::backend::{lookup, registered};

fn enabled_features() -> Vec<&'static str> {
    let mut v = Vec::new();
    if cfg!(feature = "local") {
        v.push("local");
    }
    if cfg!(feature = "tcp") {
        v.push("tcp");
    }
    if cfg!(feature = "ucx") {
        v.push("ucx");
    }
    if cfg!(feature = "fabric") {
        v.push("fabric");
    }
    if cfg!(feature = "verbs") {
        v.push("verbs");
    }
    if cfg!(feature = "cuda-ipc") {
        v.push("cuda-ipc");
    }
    v
}

#[test]
fn every_enabled_backend_is_registered_and_referenced() {
    let linked: Vec<&str> = backends::linked().iter().map(|(n, _)| *n).collect();
    let names: Vec<&str> = registered().iter().map(|d| d.name).collect();
    for f in enabled_features() {
        assert!(linked.contains(&f), "feature {f} is enabled but the facade does not reference it: {linked:?}");
        assert!(names.contains(&f), "feature {f} is enabled but {f} is not in the registry: {names:?}");
        let d = lookup(f).unwrap();
        assert_eq!(d.name, f);
    }
}

#[test]
fn unknown_names_list_the_compiled_in_backends() {
    let e = backends::create("nonesuch", &Default::default()).err().expect("nonesuch is not a backend");
    let text = e.to_string();
    for f in enabled_features() {
        assert!(text.contains(f), "{text}");
    }
}

#[cfg(feature = "local")]
#[test]
fn local_is_creatable_by_name() {
    let b = backends::create("local", &kvxfer_core::BackendConfig::new(3)).unwrap();
    assert_eq!(b.name(), "local");
}
