//! libfabric 1.17's shm endpoints cannot be closed while the process runs, so the backend recycles
//! them (see `ffi::RdmEndpoint`). A recycled endpoint keeps its address vector, and shm counts every
//! `fi_av_insert` against a limit of 256, duplicates included. This runs alone in its process, so the
//! same two endpoints serve every iteration: before the backend inserted each address once per
//! endpoint, the 257th connection of one recycled endpoint to the same peer failed with
//! "fi_av_insert ... inserted 0 of 1 addresses" (CI saw it as 20 conformance cases failing once the
//! suite had opened enough backends).

use std::time::{Duration, Instant};

use kvxfer_core::{BackendConfig, HostBuffer, KvTransferBackend, RegionId, WriteOp};
use kvxfer_fabric::FabricBackend;

const ROUNDS: usize = 600;
const LEN: usize = 4096;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recycled_shm_endpoints_connect_to_the_same_peers_again_and_again() {
    let config = |identity| BackendConfig::new(identity).with("provider", "shm").with("timeout_ms", "5000");
    for round in 0..ROUNDS {
        let a = FabricBackend::new(&config(1)).expect("open sender");
        let b = FabricBackend::new(&config(2)).expect("open receiver");
        let src: Vec<u8> = (0..LEN).map(|i| (i + round) as u8 | 1).collect();
        let dst = HostBuffer::zeroed(LEN).desc();
        let src_reg = a.register(RegionId(1), HostBuffer::from_slice(&src).desc()).await.unwrap();
        let dst_reg = b.register(RegionId(9), dst.clone()).await.unwrap();
        let peer = a
            .connect(&b.metadata().unwrap())
            .await
            .unwrap_or_else(|e| panic!("round {round}: connect to a recycled peer: {e}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        a.post(peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, LEN as u64)], None)
            .unwrap()
            .wait(deadline)
            .await
            .unwrap_or_else(|e| panic!("round {round}: write: {e}"));
        let got = dst.read_guard(0, LEN as u64).unwrap().as_slice().to_vec();
        assert_eq!(got, src, "round {round}: bytes");
        src_reg.close(deadline).await.unwrap();
        dst_reg.close(deadline).await.unwrap();
    }
}
