// SPDX-License-Identifier: MIT
//! Finds libdion.so and tells rustc how to link against it.
//!
//! Search order (the first directory holding `libdion.so` wins):
//!   1. `$LIBDION_DIR`: any directory holding libdion.so (an unusable value is an
//!      error, not skipped);
//!   2. `<crate>/../../build`: the CMake build tree of this repository
//!      (`cmake -S . -B build && cmake --build build`).
//!
//! The directory is also written into the test/example binaries' RPATH, so
//! `cargo test` and `cargo run --example train` need no LD_LIBRARY_PATH.
//!
//! The public header's directory (`$LIBDION_INCLUDE_DIR`, else `<crate>/../../include`)
//! is exported to the crate as `DION_INCLUDE_DIR`: tests/abi_layout.rs compiles a C
//! helper against it to compare struct layouts and constants with src/sys.rs.
use std::env;
use std::path::{Path, PathBuf};

const LIB_FILE: &str = "libdion.so";

fn fail(msg: &str) -> ! {
    // A build script's stderr is shown by cargo when the script fails.
    eprintln!("\nerror: dion (build.rs): {msg}\n");
    std::process::exit(1);
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBDION_DIR");
    println!("cargo:rerun-if-env-changed=LIBDION_INCLUDE_DIR");

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let repo = manifest.join("..").join("..");
    let repo = repo.canonicalize().unwrap_or(repo);

    let mut tried: Vec<String> = Vec::new();
    let lib_dir: PathBuf = match env::var_os("LIBDION_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if !dir.join(LIB_FILE).is_file() {
                fail(&format!(
                    "LIBDION_DIR={} does not contain {LIB_FILE}.\n  Set LIBDION_DIR to the directory holding \
                     {LIB_FILE} (for a CMake build of libdion: its build directory), or unset it to use \
                     {}.",
                    dir.display(),
                    repo.join("build").display()
                ));
            }
            dir
        }
        _ => {
            tried.push("$LIBDION_DIR (not set)".to_string());
            let candidate = repo.join("build");
            tried.push(candidate.join(LIB_FILE).display().to_string());
            if candidate.join(LIB_FILE).is_file() {
                candidate
            } else {
                fail(&format!(
                    "cannot find {LIB_FILE}. Looked in:\n    {}\n  Build libdion first:\n    cmake -S {repo} -B \
                     {repo}/build -G Ninja && cmake --build {repo}/build\n  or set LIBDION_DIR to the directory \
                     holding {LIB_FILE}.",
                    tried.join("\n    "),
                    repo = repo.display()
                ));
            }
        }
    };
    let lib_dir = canonical(&lib_dir);

    println!("cargo:rerun-if-changed={}", lib_dir.join(LIB_FILE).display());
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=dion");
    // RPATH for this package's tests, examples and binaries (cargo passes
    // rustc-link-arg only to those targets, never to dependents).
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    // For dependents' build scripts (`links = "dion"`): DEP_DION_LIB_DIR.
    println!("cargo:lib_dir={}", lib_dir.display());

    let include_dir = match env::var_os("LIBDION_INCLUDE_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => repo.join("include"),
    };
    if include_dir.join("dion.h").is_file() {
        let include_dir = canonical(&include_dir);
        println!("cargo:rerun-if-changed={}", include_dir.join("dion.h").display());
        println!("cargo:rustc-env=DION_INCLUDE_DIR={}", include_dir.display());
        println!("cargo:include={}", include_dir.display());
    } else {
        // Not fatal for users of the crate; tests/abi_layout.rs fails with this text.
        println!(
            "cargo:rustc-env=DION_INCLUDE_DIR_MISSING=no dion.h in {} (set LIBDION_INCLUDE_DIR)",
            include_dir.display()
        );
    }
}

fn canonical(p: &Path) -> PathBuf {
    p.canonicalize().unwrap_or_else(|e| fail(&format!("cannot resolve {}: {e}", p.display())))
}
