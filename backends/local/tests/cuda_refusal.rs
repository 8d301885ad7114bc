//! CUDA memory without a usable driver: the capabilities say so, and a registration is refused with
//! a typed error naming the library (on a host with a driver: naming why the address is not CUDA
//! memory of that device). Runs on the real driver lookup, never the emulation.

use kvxfer_core::{BackendConfig, BackendError, HostBuffer, MemKind, MemKinds, RegionId};

#[tokio::test]
async fn cuda_memory_is_claimed_only_with_a_driver_and_refused_with_the_reason() {
    let b = kvxfer_local::create(&BackendConfig::new(1)).unwrap();
    let driver = kvxfer_cuda::driver();
    assert_eq!(b.capabilities().memory.contains(&MemKind::Cuda { device: 0 }), kvxfer_cuda::available());
    assert!(b.capabilities().memory.contains(&MemKind::Host));
    let mut host = HostBuffer::zeroed(4096);
    let e = b.register(RegionId(1), host.desc_labelled(MemKind::Cuda { device: 0 })).await.unwrap_err();
    let BackendError::Unsupported { what, .. } = &e else { panic!("expected Unsupported, got {e:?}") };
    match driver {
        Err(_) => assert!(what.contains("libcuda.so.1") && what.contains("could not be loaded"), "{e}"),
        Ok(_) => assert!(what.contains("does not know") || what.contains("no CUDA device"), "{e}"),
    }
    assert_eq!(kvxfer_cuda::memory_kinds() == MemKinds::HOST, !kvxfer_cuda::available());
    b.register(RegionId(1), host.desc()).await.expect("host memory is taken after a refusal");
}
