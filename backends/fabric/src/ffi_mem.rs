//! Describing a message buffer as a [`MemRegion`] for registration under `FI_MR_LOCAL`.
#![allow(unsafe_code)]

use std::ptr::NonNull;

use kvxfer_core::MemRegion;

/// Describes the heap buffer of a non-empty `Vec` as a region.
///
/// The caller (the endpoint's send path) keeps the Vec alive and unmoved-in-heap (moving the Vec value
/// does not move its heap buffer) and closes the registration before dropping the Vec, which is what
/// `from_raw_parts` requires.
pub(crate) fn vec_region(v: &[u8]) -> MemRegion {
    let p = NonNull::new(v.as_ptr() as *mut u8).unwrap_or(NonNull::dangling());
    // SAFETY: see above: the buffer outlives the registration that uses this description, and the
    // provider only reads it (FI_SEND access).
    unsafe { MemRegion::from_raw_parts(p, v.len()) }
}
