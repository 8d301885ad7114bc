//! Without a usable CUDA driver a cuda-ipc endpoint is made but claims no memory kind and refuses
//! CUDA memory naming the library; host memory is always refused, naming the backends that take it.
//! Runs on the real driver lookup, never the emulation.

use kvxfer_core::{BackendConfig, BackendError, HostBuffer, MemKind, MemKinds, RegionId};

#[tokio::test]
async fn host_memory_and_cuda_without_a_driver_are_refused_with_the_reason() {
    let b = kvxfer_cuda_ipc::create(&BackendConfig::new(1)).unwrap();
    let caps = b.capabilities();
    assert_eq!(caps.memory, if kvxfer_cuda::available() { MemKinds::CUDA } else { MemKinds::NONE });
    assert!(caps.cross_process && !caps.cross_host);
    let mut host = HostBuffer::zeroed(4096);
    let e = b.register(RegionId(1), host.desc()).await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Unsupported { what, .. } if what.contains("tcp and local take host memory")),
        "{e}"
    );
    let e = b.register(RegionId(1), host.desc_labelled(MemKind::Cuda { device: 0 })).await.unwrap_err();
    let BackendError::Unsupported { what, .. } = &e else { panic!("expected Unsupported, got {e:?}") };
    if kvxfer_cuda::driver().is_err() {
        assert!(what.contains("libcuda.so.1"), "{e}");
    }
    // Metadata of an endpoint without regions is still well formed, and a peer on another boot is refused.
    let mut m = b.metadata().unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
    v["boot_id"] = "another-boot".into();
    m.payload = serde_json::to_vec(&v).unwrap();
    let a = kvxfer_cuda_ipc::create(&BackendConfig::new(2)).unwrap();
    let e = a.connect(&m).await.unwrap_err().to_string();
    if std::path::Path::new("/proc/sys/kernel/random/boot_id").exists() {
        assert!(e.contains("same node"), "{e}");
    }
}
