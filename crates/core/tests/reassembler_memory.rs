//! Regression test for an allocation sized by an untrusted field: a notification fragment says how
//! many fragments its message has (up to 65535), and the reassembler used to allocate a slot for
//! each of them on the first fragment (24 bytes each: 1.5 MiB for a 14-byte fragment, 6 GiB for the
//! 4096 partial messages a libfabric endpoint keeps). It now holds only the fragments that arrived.
//! The input is also in the fuzz corpus (`fuzz/corpus/fabric_wire/edge-fragment-count-amplification`).

#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use kvxfer_core::toolkit::Reassembler;

/// Counts the bytes allocated and not freed (this test binary runs one test).
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A first fragment (index 0) of message `id` that claims 65535 fragments, with one byte of body.
fn fragment(id: u64) -> Vec<u8> {
    let mut f = vec![0x46, 1];
    f.extend_from_slice(&id.to_le_bytes());
    f.extend_from_slice(&0u16.to_le_bytes());
    f.extend_from_slice(&u16::MAX.to_le_bytes());
    f.push(0xaa);
    f
}

#[test]
fn regression_fragment_count_does_not_size_an_allocation() {
    let fragments: Vec<Vec<u8>> = (0..256).map(fragment).collect();
    let mut r = Reassembler::new(1 << 20, 4096);
    let now = Instant::now();
    let before = LIVE.load(Ordering::Relaxed);
    for f in &fragments {
        assert_eq!(r.push(1, f, now).expect("a valid first fragment"), None);
    }
    assert_eq!(r.pending(), 256);
    let held = LIVE.load(Ordering::Relaxed) - before;
    // 256 partial messages of one byte each; before the fix this was 256 * 65535 * 24 bytes (384 MiB).
    assert!(held < 1 << 20, "256 one-byte partial messages hold {held} bytes");
}
