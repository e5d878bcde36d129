// The model and GPU catalogue: YAML files under models/, embedded in the binary at build time so
// that the planner runs from anywhere, plus files the user names by path.
//
// Every loader validates every field: unknown keys, wrong types, missing or non-positive values,
// heads that do not divide, ... throw InputError with one line naming the file, the key, its
// line and what is accepted.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/models/model_spec.h"

namespace ctxplan {

// A catalogue name ("qwen2.5-7b", case-insensitive) or a path to a YAML file or to a Hugging Face
// config.json (anything containing '/' or ending in .yaml/.yml/.json is taken as a path).
ModelSpec LoadModel(std::string_view name_or_path);
GpuSpec LoadGpu(std::string_view name_or_path);
// A machine preset ("h200-125g") or a path to a machine YAML file.
MachineSpec LoadMachine(std::string_view name_or_path);
// Whether LoadModel / LoadGpu / LoadMachine take `name_or_path` as a file: it contains '/' or
// ends in .yaml, .yml or .json (any case); otherwise it is a catalogue name.
bool NamesAFile(std::string_view name_or_path);
// A custom machine: a GPU and the host RAM it sits with.
MachineSpec MakeMachine(const GpuSpec& gpu, int64_t host_ram_bytes);

// The whole file at `path`; an InputError naming it when it cannot be read (or is a folder).
std::string ReadTextFile(std::string_view path);

// Parse from text; `source` names the file in error messages.
ModelSpec ParseModelYaml(std::string_view text, std::string_view source);
ModelSpec ParseHfConfigJson(std::string_view text, std::string_view source);
GpuSpec ParseGpuYaml(std::string_view text, std::string_view source);
MachineSpec ParseMachineYaml(std::string_view text, std::string_view source);

std::vector<std::string> CatalogModelNames();
std::vector<std::string> CatalogGpuNames();
std::vector<std::string> CatalogMachineNames();

}  // namespace ctxplan
