//! CUDA memory on libfabric: refused with what registration would need and what to use instead.

use kvxfer_core::{BackendConfig, BackendError, HostBuffer, MemKind, RegionId};

#[tokio::test]
async fn cuda_memory_is_refused_naming_fi_hmem_and_the_alternatives() {
    let c = BackendConfig::new(1).with("provider", "tcp").with("addr", "127.0.0.1");
    let b = kvxfer_fabric::create(&c).unwrap();
    assert!(!b.capabilities().memory.contains(&MemKind::Cuda { device: 0 }));
    let mut host = HostBuffer::zeroed(4096);
    let e = b.register(RegionId(1), host.desc_labelled(MemKind::Cuda { device: 0 })).await.unwrap_err();
    let ok = matches!(&e, BackendError::Unsupported { what, .. }
        if what.contains("FI_HMEM_CUDA") && what.contains("tcp backend") && what.contains("cuda-ipc"));
    assert!(ok, "{e}");
}
