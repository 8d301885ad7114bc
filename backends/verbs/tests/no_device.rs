//! What the backend does on a host without an RDMA device (this CI machine): constructing it fails
//! with a typed no-device error that carries what `ibv_get_device_list` said, and nothing leaks or hangs.
//! On a host with a device these tests check the opposite: the endpoint opens and publishes metadata.
//! A build with the `emulator` feature behaves the same here: the model is only used when asked for
//! (`device=emulated`), never instead of a real device.

use std::time::{Duration, Instant};

use kvxfer_core::{BackendConfig, BackendError, Completion, EndpointMetadata, MemKinds};

fn device_present() -> bool {
    kvxfer_verbs::no_device_reason(&BackendConfig::new(0)).is_none()
}

#[test]
fn create_fails_cleanly_without_a_device() {
    if device_present() {
        let b = kvxfer_verbs::create(&BackendConfig::new(7)).expect("a device is present, so create must succeed");
        let m = b.metadata().unwrap();
        assert_eq!(m.backend, "verbs");
        assert_eq!(m.identity, 7);
        return;
    }
    let t = Instant::now();
    for _ in 0..3 {
        match kvxfer_verbs::create(&BackendConfig::new(1)) {
            Err(BackendError::NoDevice { backend: "verbs", detail }) => {
                assert!(
                    detail.contains("ibv_get_device_list") || detail.contains("port"),
                    "the reason names what failed: {detail}"
                );
                assert!(
                    detail.contains("rdma link add") || detail.contains("port"),
                    "the reason says what to do: {detail}"
                );
            }
            Err(e) => panic!("expected NoDevice, got {e}"),
            Ok(_) => panic!("create succeeded although no_device_reason reported no device"),
        }
    }
    assert!(t.elapsed() < Duration::from_secs(5), "failing to open must be prompt");
    let reason = kvxfer_verbs::no_device_reason(&BackendConfig::new(0)).unwrap();
    assert!(reason.starts_with("verbs: no device:"), "{reason}");
}

#[test]
fn a_missing_named_device_or_bad_option_is_reported_as_such() {
    // Option errors come before any device access.
    let e = kvxfer_verbs::create(&BackendConfig::new(1).with("ring_slots", "0")).err().expect("bad option");
    assert!(matches!(e, BackendError::Config { .. }), "{e}");
    let e = kvxfer_verbs::create(&BackendConfig::new(1).with("colour", "red")).err().expect("unknown option");
    assert!(e.to_string().contains("known options"), "{e}");
    let e = kvxfer_verbs::create(&BackendConfig::new(1).with("device", "no_such_hca_9")).err().expect("no such device");
    match e {
        BackendError::NoDevice { detail, .. } => {
            assert!(detail.contains("no_such_hca_9") || detail.contains("ibv_get_device_list"), "{detail}")
        }
        other => panic!("expected NoDevice, got {other}"),
    }
}

#[test]
fn the_registry_lists_verbs_with_its_capabilities() {
    let d = kvxfer_core::backend::lookup("verbs").expect("the crate submits its descriptor");
    let c = d.capabilities;
    assert!(c.attached && c.out_of_band && c.cross_host);
    assert_eq!(c.memory, MemKinds::HOST, "no dmabuf or CUDA registration is claimed");
    assert_eq!(c.completion, Completion::Remote);
    assert!(c.limits.max_ops_per_post < u64::MAX && c.limits.max_notification_bytes < u64::MAX);
    // The registry says whether this build includes the in-process model.
    assert_eq!(d.description.contains("model"), kvxfer_verbs::EMULATED, "{}", d.description);
    if !device_present() {
        assert!(matches!((d.create)(&BackendConfig::new(3)), Err(BackendError::NoDevice { .. })));
    }
}

#[test]
fn the_model_is_chosen_only_by_name() {
    let cfg = BackendConfig::new(4).with("device", kvxfer_verbs::EMULATED_DEVICE);
    match (kvxfer_verbs::create(&cfg), kvxfer_verbs::EMULATED) {
        (Ok(b), true) => {
            assert!(!b.capabilities().cross_process, "a model endpoint says it cannot leave the process")
        }
        (Err(BackendError::Config { detail, .. }), false) => assert!(detail.contains("emulator"), "{detail}"),
        (r, built) => {
            panic!("device=emulated in a build {} the model: {:?}", if built { "with" } else { "without" }, r.err())
        }
    }
}

#[test]
fn metadata_payload_of_another_backend_is_not_an_address() {
    // What connect checks first: a tcp endpoint's payload does not parse as a verbs address.
    let foreign = EndpointMetadata { version: 1, backend: "tcp".into(), identity: 1, payload: b"127.0.0.1:9".to_vec() };
    assert!(kvxfer_verbs::wire::Address::from_payload(&foreign.payload).is_err());
}
