//! Endpoint metadata: the JSON envelope (EndpointMetadata, `check`) and every network backend's
//! payload parser (tcp, ucx, fabric, verbs), on the input as an envelope and as a bare payload.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvxfer_tcp::fuzzing::metadata(data);
    kvxfer_ucx::fuzzing::metadata(data);
    kvxfer_fabric::fuzzing::metadata(data);
    kvxfer_verbs::fuzzing::metadata(data);
});
