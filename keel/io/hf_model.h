// Hugging Face model directories in and out (DESIGN §6), and PEFT adapter directories: one header
// for the three concepts, each in its own file.
#pragma once
#include "keel/io/hf_config.h"   // config.json
#include "keel/io/hf_weights.h"  // the weights, single or sharded
#include "keel/io/peft_dir.h"    // PEFT adapter directories
