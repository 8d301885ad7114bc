//! TCP backend handshake: HELLO and HELLO reply.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvxfer_tcp::fuzzing::handshake(data);
});
