//! CUDA memory on a UCX without CUDA transports (Debian's): refused with the UCX build that is needed.

use kvxfer_core::{BackendConfig, BackendError, HostBuffer, MemKind, RegionId};

#[tokio::test]
async fn cuda_memory_is_refused_naming_the_ucx_build_needed() {
    let b = kvxfer_ucx::create(&BackendConfig::new(1).with("tls", "tcp")).unwrap();
    let cuda = MemKind::Cuda { device: 0 };
    if b.capabilities().memory.contains(&cuda) {
        eprintln!("this UCX registers CUDA memory: nothing to refuse");
        return;
    }
    let mut host = HostBuffer::zeroed(4096);
    let e = b.register(RegionId(1), host.desc_labelled(cuda)).await.unwrap_err();
    assert!(
        matches!(&e, BackendError::Unsupported { what, .. } if what.contains("--with-cuda") && what.contains("cuda_copy")),
        "{e}"
    );
}
