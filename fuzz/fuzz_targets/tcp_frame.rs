//! TCP backend frames after the handshake: headers, op descriptors admitted by the receiver, NOTE and ERROR bodies.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvxfer_tcp::fuzzing::frames(data);
});
