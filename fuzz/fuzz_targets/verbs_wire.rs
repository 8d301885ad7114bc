//! ibverbs backend: the TCP side channel's frames (handshake and after) and the notification ring's completions.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvxfer_verbs::fuzzing::wire(data);
});
