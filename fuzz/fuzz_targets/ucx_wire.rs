//! UCX backend active messages: header and every kind's body.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvxfer_ucx::fuzzing::message(data);
});
