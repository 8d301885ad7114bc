//! libfabric backend messages: header, hello and revoke bodies, notification fragments and staging.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvxfer_fabric::fuzzing::messages(data);
});
