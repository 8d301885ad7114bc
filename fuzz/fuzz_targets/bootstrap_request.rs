//! Bootstrap protocol: request lines (signed and not), store calls, registrations, responses.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvxfer::fuzzing::request(data);
});
