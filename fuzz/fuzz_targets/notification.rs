//! Notification codec: kvxfer_core::Notification::decode, re-encoding to the canonical form.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvxfer_core::fuzzing::notification(data);
});
