//! The driver surface end to end: on the real driver with `KVXFER_TEST_CUDA=real` (a GPU machine),
//! else on the emulated one. Prints what it finds (driver, devices, pointer kinds, IPC, dma-buf) so
//! that a first run on a new machine says what works there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{HostBuffer, MemKind};
use kvxfer_cuda::stream::Event;
use kvxfer_cuda::{context, driver, CopyPlan, DeviceBuffer, PinnedBuffer, Shape, Stream};

fn setup() -> bool {
    if std::env::var("KVXFER_TEST_CUDA").is_ok_and(|v| v == "real") {
        match driver() {
            Ok(d) => {
                eprintln!("driver: {d:?}");
                true
            }
            Err(e) => panic!("KVXFER_TEST_CUDA=real but {e}"),
        }
    } else {
        kvxfer_cuda::emulation::install();
        false
    }
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

/// Copies `data` to a new device buffer (through a plan from host memory).
fn upload(stream: &Stream, data: &[u8]) -> kvxfer_core::MemDesc {
    let dev = DeviceBuffer::new(stream.context(), data.len()).unwrap().into_desc();
    let mut h = HostBuffer::from_slice(data);
    let hd = h.desc();
    let l = data.len() as u64;
    let mut plan = CopyPlan::new();
    plan.copy(
        hd.reserve(0, l, 1, l, false).unwrap(),
        Shape::contiguous(0, l),
        dev.reserve(0, l, 1, l, true).unwrap(),
        Shape::contiguous(0, l),
    )
    .unwrap();
    stream.submit(plan).unwrap().wait_blocking(stream, deadline()).unwrap();
    dev
}

fn download(stream: &Stream, dev: &kvxfer_core::MemDesc) -> Vec<u8> {
    let l = dev.len() as u64;
    let mut plan = CopyPlan::with_pinned(PinnedBuffer::new(stream.context(), dev.len()).unwrap());
    plan.to_pinned(dev.reserve(0, l, 1, l, false).unwrap(), Shape::contiguous(0, l), 0).unwrap();
    let p = stream.submit(plan).unwrap();
    p.wait_blocking(stream, deadline()).unwrap();
    p.finish().unwrap().pinned.unwrap().as_slice().to_vec()
}

#[test]
fn devices_and_pointers_are_described() {
    let real = setup();
    let d = driver().unwrap();
    let n = d.device_count().unwrap();
    assert!(n > 0);
    for i in 0..n {
        let info = d.device_info(i).unwrap();
        eprintln!(
            "device {i}: {} {} bus {} uva {} dma-buf {} gpudirect-rdma {}",
            info.name,
            info.uuid_string(),
            info.pci_bus_id,
            info.unified_addressing,
            info.dma_buf,
            info.gpudirect_rdma
        );
    }
    let ctx = context(0).unwrap();
    let buf = DeviceBuffer::new(&ctx, 1 << 20).unwrap();
    let info = d.pointer_info(buf.ptr() + 4096).unwrap();
    assert_eq!(info.device, Some(0), "{info:?}");
    eprintln!("a cuMemAlloc pointer: {info:?}");
    let host = [0u8; 64];
    assert_eq!(d.pointer_info(host.as_ptr() as u64).unwrap().device, None);
    let desc = buf.into_desc();
    assert_eq!(desc.kind(), MemKind::Cuda { device: 0 });
    kvxfer_cuda::check_register("test", &desc).unwrap();
    match kvxfer_cuda::dmabuf::export(&desc) {
        Ok((fd, off)) => eprintln!("dma-buf export: fd {fd:?}, offset {off}"),
        Err(e) => eprintln!("dma-buf export refused: {e}"),
    }
    if real {
        eprintln!("real driver: {} (CUDA {})", d.library(), d.version_string());
    }
}

#[test]
fn strided_copies_through_pinned_slots_and_device_to_device_keep_every_byte() {
    setup();
    let ctx = context(0).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let data = pattern(1 << 20, 7);
    let dev = upload(&stream, &data);
    assert_eq!(download(&stream, &dev), data, "host -> device -> pinned");
    // 300 rows of 96 bytes, 1000 apart, packed into a slot; then back into rows 4096 apart elsewhere.
    let mut plan = CopyPlan::with_pinned(PinnedBuffer::new(&ctx, 1 << 20).unwrap());
    let rows = Shape { offset: 0, len: 96, count: 300, stride: 1000 };
    plan.to_pinned(dev.reserve(5, 96, 300, 1000, false).unwrap(), rows, 64).unwrap();
    let p = stream.submit(plan).unwrap();
    p.wait_blocking(&stream, deadline()).unwrap();
    let slot = p.finish().unwrap().pinned.unwrap();
    let want: Vec<u8> = (0..300).flat_map(|r| data[5 + r * 1000..5 + r * 1000 + 96].to_vec()).collect();
    assert_eq!(&slot.as_slice()[64..64 + want.len()], &want[..], "strided device -> packed pinned");
    let other = upload(&stream, &vec![0xEE; 2 << 20]);
    let mut plan = CopyPlan::with_pinned(slot);
    plan.from_pinned(
        64,
        other.reserve(100, 96, 300, 4096, true).unwrap(),
        Shape { offset: 0, len: 96, count: 300, stride: 4096 },
    )
    .unwrap();
    stream.submit(plan).unwrap().wait_blocking(&stream, deadline()).unwrap();
    let got = download(&stream, &other);
    for r in 0..300 {
        assert_eq!(&got[100 + r * 4096..100 + r * 4096 + 96], &want[r * 96..(r + 1) * 96], "row {r}");
        assert!(got[100 + r * 4096 + 96..100 + (r + 1) * 4096].iter().all(|b| *b == 0xEE), "between rows {r}");
    }
    // Device to device, strided on both sides, while another copy runs on a second stream.
    let s2 = Stream::new(&ctx).unwrap();
    let third = upload(&s2, &vec![0u8; 1 << 20]);
    let ev = Event::new(&ctx).unwrap();
    let mut plan = CopyPlan::new();
    plan.copy(
        dev.reserve(0, 64, 1000, 512, false).unwrap(),
        Shape { offset: 0, len: 64, count: 1000, stride: 512 },
        third.reserve(0, 64, 1000, 1024, true).unwrap(),
        Shape { offset: 0, len: 64, count: 1000, stride: 1024 },
    )
    .unwrap();
    let p = s2.submit(plan).unwrap();
    ev.record(&s2).unwrap();
    stream.wait_event(&ev).unwrap();
    stream.synchronize().unwrap();
    assert!(ev.is_done().unwrap(), "a stream that waited for the event sees it complete");
    p.wait_blocking(&s2, deadline()).unwrap();
    drop(p);
    let got = download(&stream, &third);
    for r in 0..1000 {
        assert_eq!(&got[r * 1024..r * 1024 + 64], &data[r * 512..r * 512 + 64], "d2d row {r}");
    }
}

#[test]
fn ipc_export_and_same_process_import() {
    setup();
    let ctx = context(0).unwrap();
    let stream = Stream::new(&ctx).unwrap();
    let dev = upload(&stream, &pattern(1 << 16, 3));
    let e = kvxfer_cuda::ipc::export(&dev).unwrap();
    eprintln!("export: offset {} of a {}-byte allocation on device {}", e.offset, e.alloc_len, e.device);
    let m = kvxfer_cuda::ipc::import(&ctx, e.handle, e.alloc_len, std::process::id()).unwrap();
    let again = kvxfer_cuda::ipc::import(&ctx, e.handle, e.alloc_len, std::process::id()).unwrap();
    assert!(Arc::ptr_eq(&m, &again));
    // Copy through the mapping into the allocation itself: the bytes arrive.
    let src = upload(&stream, &pattern(4096, 9));
    let mut plan = CopyPlan::new();
    plan.to_mapping(
        src.reserve(0, 4096, 1, 4096, false).unwrap(),
        Shape::contiguous(0, 4096),
        &m,
        e.offset + 1024,
        4096,
    )
    .unwrap();
    stream.submit(plan).unwrap().wait_blocking(&stream, deadline()).unwrap();
    let got = download(&stream, &dev);
    assert_eq!(&got[1024..1024 + 4096], &pattern(4096, 9)[..]);
    assert!(m.len() >= 1 << 16);
}
