//! Generates bindings to the system UCX (found with pkg-config) and links ucp, uct and ucs.
//!
//! Only the symbols the safe wrapper in `kvxfer-ucx` uses are allowlisted. Needs `libucx-dev`,
//! `pkg-config` and libclang (`libclang-dev` or `clang`) at build time.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");

    let ucx = match pkg_config::Config::new().atleast_version("1.10").cargo_metadata(false).probe("ucx") {
        Ok(lib) => lib,
        Err(e) => panic!(
            "kvxfer-ucx-sys needs the UCX development files (Debian/Ubuntu: `apt-get install libucx-dev \
             pkg-config libclang-dev`); pkg-config could not find ucx >= 1.10: {e}"
        ),
    };
    for dir in &ucx.link_paths {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    // ucp's API is split over three libraries; ucp alone leaves uct/ucs symbols to chance.
    for lib in ["ucp", "uct", "ucs"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    println!("cargo:version={}", ucx.version);

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        // The workspace's rust-version (1.80): no `unsafe extern` blocks (1.82) in the output.
        .rust_target(bindgen::RustTarget::stable(80, 0).expect("a valid Rust target"))
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        // ucs_status_t and the flag enums stay plain integers with constants: C may hand us any value.
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .layout_tests(true)
        .derive_default(false)
        .derive_debug(false)
        .generate_comments(false);
    for dir in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", dir.display()));
    }
    let functions = [
        "ucp_config_read",
        "ucp_config_modify",
        "ucp_config_release",
        "ucp_init_version",
        "ucp_cleanup",
        "ucp_worker_create",
        "ucp_worker_destroy",
        "ucp_worker_get_address",
        "ucp_worker_release_address",
        "ucp_worker_progress",
        "ucp_worker_get_efd",
        "ucp_worker_arm",
        "ucp_worker_signal",
        "ucp_worker_set_am_recv_handler",
        "ucp_ep_create",
        "ucp_ep_close_nbx",
        "ucp_ep_flush_nbx",
        "ucp_mem_map",
        "ucp_mem_unmap",
        "ucp_rkey_pack",
        "ucp_rkey_buffer_release",
        "ucp_ep_rkey_unpack",
        "ucp_rkey_destroy",
        "ucp_put_nbx",
        "ucp_am_send_nbx",
        "ucp_am_data_release",
        "ucp_request_check_status",
        "ucp_request_free",
        "ucp_request_cancel",
        "ucp_context_query",
        "ucp_get_version_string",
        "ucs_status_string",
    ];
    for f in functions {
        builder = builder.allowlist_function(f);
    }
    for t in [
        "ucs_status_t",
        "ucp_params_field",
        "ucp_feature",
        "ucp_worker_params_field",
        "ucs_thread_mode_t",
        "ucp_ep_params_field",
        "ucp_err_handling_mode_t",
        "ucp_ep_close_flags_t",
        "ucp_mem_map_params_field",
        "ucp_op_attr_t",
        "ucp_am_handler_param_field",
        "ucp_am_recv_attr_t",
        "ucp_send_am_flags",
        "ucp_am_cb_flags",
        "ucp_context_attr_field",
        "ucs_memory_type_t",
    ] {
        builder = builder.allowlist_type(t);
    }
    builder = builder.allowlist_var("UCP_API_MAJOR").allowlist_var("UCP_API_MINOR");

    let bindings = builder.generate().expect("bindgen failed on <ucp/api/ucp.h>; is libclang installed?");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings.write_to_file(out.join("bindings.rs")).expect("writing bindings.rs");
}
