//! Finds the system libfabric with pkg-config, compiles the C shim for its `static inline` calls, and
//! generates bindings with bindgen.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=shim/shim.h");
    println!("cargo:rerun-if-changed=shim/shim.c");
    println!("cargo:rerun-if-changed=build.rs");

    let lib = match pkg_config::Config::new().atleast_version("1.17").probe("libfabric") {
        Ok(lib) => lib,
        Err(e) => {
            // A build script cannot return a typed error; this message is what the user sees.
            eprintln!(
                "kvxfer-fabric-sys needs libfabric >= 1.17 with its headers and pkg-config file \
                 (Debian/Ubuntu: apt-get install libfabric-dev pkg-config). pkg-config said: {e}"
            );
            std::process::exit(1);
        }
    };

    let mut build = cc::Build::new();
    build.file("shim/shim.c").warnings(true);
    for p in &lib.include_paths {
        build.include(p);
    }
    build.compile("kvx_fabric_shim");

    let mut bindings = bindgen::Builder::default()
        .header("shim/shim.h")
        .allowlist_function("kvx_.*")
        .allowlist_function("fi_getinfo|fi_freeinfo|fi_dupinfo|fi_fabric|fi_strerror|fi_version")
        .allowlist_type("fi_.*|fid_.*|fid")
        .allowlist_var("FI_.*")
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for p in &lib.include_paths {
        bindings = bindings.clang_arg(format!("-I{}", p.display()));
    }
    let bindings = bindings.generate().unwrap_or_else(|e| {
        eprintln!("kvxfer-fabric-sys: bindgen failed on the libfabric headers (is libclang installed? apt-get install libclang-dev): {e}");
        std::process::exit(1);
    });
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings.write_to_file(out.join("bindings.rs")).unwrap_or_else(|e| {
        eprintln!("kvxfer-fabric-sys: writing bindings.rs failed: {e}");
        std::process::exit(1);
    });
}
