//! CUDA memory on verbs (over the in-process verbs model): refused naming the GPUDirect paths, what
//! this host offers for them, and what to use instead.

use kvxfer_core::{BackendConfig, BackendError, HostBuffer, MemKind, RegionId};

#[tokio::test]
async fn cuda_memory_is_refused_naming_gpudirect_and_the_alternatives() {
    let b = kvxfer_verbs::create_emulated(&BackendConfig::new(1)).expect("the emulated device opens");
    assert!(!b.capabilities().memory.contains(&MemKind::Cuda { device: 0 }));
    let mut host = HostBuffer::zeroed(4096);
    let e = b.register(RegionId(1), host.desc_labelled(MemKind::Cuda { device: 0 })).await.unwrap_err();
    let ok = matches!(&e, BackendError::Unsupported { what, .. }
        if what.contains("ibv_reg_dmabuf_mr") && what.contains("nvidia-peermem") && what.contains("tcp backend"));
    assert!(ok, "{e}");
}
